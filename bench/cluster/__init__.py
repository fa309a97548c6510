"""A cluster on one machine: nodes and services as network namespaces (issue #25)."""
