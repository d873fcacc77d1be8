# Turnstile proxy image: a wheel built in one stage, installed into a slim runtime with
# a non-root user. Build: docker build -t turnstile .
# Run:   docker run -p 8100:8100 -v $PWD/out:/data -e TURNSTILE_CLIENT_KEY=... turnstile \
#          serve --backend http://vllm:8000 --host 0.0.0.0 --api-key-env TURNSTILE_CLIENT_KEY
# (see compose.yaml for Turnstile next to vLLM).
ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler for turnstile.proxy._tokenscan (without one the wheel decodes in Python).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY turnstile ./turnstile
# Wheels of Turnstile and its dependencies (S3 is built into pyarrow; the extra adds
# fsspec for other object stores).
RUN pip wheel --wheel-dir /wheels '.[objstore]'

FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 turnstile \
    && mkdir /data && chown turnstile /data
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels 'turnstile[objstore]'
USER turnstile
WORKDIR /home/turnstile
EXPOSE 8100
VOLUME ["/data"]
# /health is 503 while recording fails or while draining.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(0 if u.urlopen('http://127.0.0.1:8100/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["turnstile"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8100", "--output", "/data", \
     "--api-key-env", "TURNSTILE_CLIENT_KEY"]
