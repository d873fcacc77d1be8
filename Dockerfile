# Turnstile proxy image. Build: docker build -t turnstile .
# Run:   docker run -p 8100:8100 -v $PWD/out:/data turnstile \
#          serve --backend http://vllm:8000 --host 0.0.0.0 --output /data
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY turnstile ./turnstile
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 turnstile \
    && mkdir /data && chown turnstile /data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER turnstile
WORKDIR /home/turnstile
EXPOSE 8100
VOLUME ["/data"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=2).status == 200 else 1)"
ENTRYPOINT ["turnstile"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8100", "--output", "/data"]
