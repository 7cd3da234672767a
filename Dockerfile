# One image for every Megha role; the command picks it:
#   megha gm --id gm-1 | megha lm --id lm-1 | megha worker --lm lm-1 --count 8 | megha predictor
# Built from wheels made on the host (scripts/wheelhouse.sh -> .offline/wheelhouse), so the
# build needs no network. The base defaults to the public python:3.11-slim; on a host with
# no image registry, scripts/offline_images.sh builds an equivalent one from Debian packages.
# Plain Dockerfile syntax: the legacy builder (docker-compose v1) and BuildKit both take it.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS install
COPY .offline/wheelhouse /wheelhouse
RUN python -m venv /opt/megha \
 && /opt/megha/bin/pip install --no-cache-dir --no-index --find-links /wheelhouse megha \
 && /opt/megha/bin/megha --help >/dev/null

FROM ${PYTHON_IMAGE}
RUN useradd --system --create-home --uid 10001 --user-group megha \
 && install -d -o megha -g megha /var/lib/megha
COPY --from=install /opt/megha /opt/megha
COPY docker/healthcheck.py docker/replay.py /usr/local/share/megha/
COPY docker/federation.yaml /etc/megha/federation.yaml
ENV PATH=/opt/megha/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MEGHA_CONFIG=/etc/megha/federation.yaml
USER megha
WORKDIR /home/megha
# grpc.health.v1 Check against this container's own server (role from the main process's
# command line); roles without a gRPC server (worker, one-shot commands) are healthy
# while they run.
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
  CMD ["python", "/usr/local/share/megha/healthcheck.py"]
CMD ["megha", "--help"]
