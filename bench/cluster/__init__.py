"""A cluster on one machine: nodes and services as network namespaces (issue #25); the bench is
``python -m bench.cluster`` (bench/cluster/run.py), engine replicas on the nodes in regret.py."""
