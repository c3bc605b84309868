# A slim image of the gateway (remote providers only; add the engine extra for a local model).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY engine_backend ./engine_backend
RUN pip install --no-compile . \
    && useradd --system --uid 10001 firsttoken

USER firsttoken
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["firsttoken", "serve", "--host", "0.0.0.0", "--port", "8080"]
