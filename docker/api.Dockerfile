# The API pod image: FastAPI + uvicorn, no model code.
# Build from the repository root: docker build -f docker/api.Dockerfile -t duplex-serve-api .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY plugins ./plugins
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin duplex
USER 10001
EXPOSE 8000
ENTRYPOINT ["duplex"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
