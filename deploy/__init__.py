"""Deployment artefacts (Helm chart, plain manifest, Dockerfile) and the script that renders them."""
