# A stand-in for rabbitmq:3-management built from Debian packages only
# (scripts/offline_images.sh): AMQP on 5672, the management UI on 15672, in the
# foreground as user rabbitmq, data in /var/lib/rabbitmq (mount a volume there).
ARG BASE=megha-offline/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends rabbitmq-server \
 && rm -rf /var/lib/apt/lists/* \
 && rabbitmq-plugins enable --offline rabbitmq_management \
 && printf '%s\n' \
      'loopback_users.guest = false' \
      'listeners.tcp.default = 5672' \
      'management.tcp.port = 15672' \
      > /etc/rabbitmq/rabbitmq.conf \
 && rm -f /etc/rabbitmq/rabbitmq-env.conf \
 && mkdir -p /var/lib/rabbitmq /var/log/rabbitmq \
 && chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq
# Like the official image: log to stdout, and `rabbitmq-diagnostics` run by root (docker
# exec) shares the server's Erlang cookie.
ENV RABBITMQ_LOGS=- HOME=/var/lib/rabbitmq
RUN ln -sf /var/lib/rabbitmq/.erlang.cookie /root/.erlang.cookie
USER rabbitmq
EXPOSE 5672 15672
# /usr/lib/...: the /usr/sbin wrapper would send the logs to a file instead of stdout.
CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
