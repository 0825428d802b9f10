"""Generated gRPC stubs for the kubelet plugin APIs. Do not edit.

Regenerate with ``python proto/generate.py`` after changing ``proto/dra/*.proto``.
"""
