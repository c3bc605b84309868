# The gateway with the bundled engine on CPU torch. With no provider key and no route it serves
# the random-weight demo model, so `docker run` answers chat requests at once, without keys.
# Build: docker build -t firsttoken .   (see the README's "Docker" section)
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# The Makefile's pin. From PyPI, `.[engine]` would pull a multi-GB CUDA build of torch, so torch
# comes first from the CPU index; `torch>=2.4` in the extra is then already met.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    FIRSTTOKEN_CACHE_DIR=/opt/firsttoken/cache
RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY engine_backend ./engine_backend
# Bytecode is compiled here (pip's default): at run time the user cannot write it, and
# compiling torch on every start would slow it by seconds. The demo model is built here too,
# so the container needs no writable disk; its folder is private (0700) until the chmod.
RUN pip install ".[engine]" \
    && python -c "import torch; assert not torch.version.cuda, torch.__version__" \
    && python -c "from engine_backend.demo import build_demo_model; print(build_demo_model())" \
    && chmod -R a+rX /opt/firsttoken

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    FIRSTTOKEN_CACHE_DIR=/opt/firsttoken/cache
# A numeric USER lets Kubernetes' runAsNonRoot verify it; the passwd entry is for tools that
# look the user up. The venv and the prebuilt demo model stay root-owned and read-only.
RUN groupadd --system --gid 10001 firsttoken \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin firsttoken
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/firsttoken /opt/firsttoken
USER 10001:10001
EXPOSE 8080
# /healthz: the process answers. Orchestrators should also gate traffic on /readyz, which stays
# 503 until every route's upstream is ready (the engine loaded, for the demo).
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["firsttoken", "serve", "--host", "0.0.0.0", "--port", "8080"]
