"""The opaque configuration users put in claims and classes: its API, precedence and quantities."""
