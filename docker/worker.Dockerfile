# The worker pod image: the session engine, the model plugins and vLLM (GPU).
# Build from the repository root: docker build -f docker/worker.Dockerfile -t duplex-serve-worker .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY plugins ./plugins
RUN pip install --no-cache-dir --prefix=/install ".[vllm,assistant]" \
 && pip install --no-cache-dir --prefix=/install --no-deps "silero-vad==6.2.3"

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin duplex
USER 10001
EXPOSE 8081
ENTRYPOINT ["duplex"]
CMD ["worker", "--plugin", "echo"]
