"""The daemon's settings: ``store_config`` defines, loads and validates StoreConfig (defaults < YAML
< env < flags); ``flags`` is the flag table beside it (each flag with its ``TIERKV_*`` variable);
``sizes`` reads and writes byte sizes (Kubernetes units); ``tier_secrets`` checks and reads the shared
tiers' secrets (the MAC secrets, the Redis password, the S3 keys, TLS CA files).
"""
