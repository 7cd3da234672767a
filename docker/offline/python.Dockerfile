# A stand-in for python:3.11-slim built from Debian packages only (scripts/offline_images.sh).
# Debian bookworm's python3 is 3.11; a venv on PATH gives `python` and `pip` as the
# official image has them, and pip installs into it without --break-system-packages.
ARG BASE=megha-offline/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /usr/local/python \
 && /usr/local/python/bin/python -m pip --version
ENV PATH=/usr/local/python/bin:$PATH
CMD ["python3"]
