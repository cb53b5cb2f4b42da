# HAProxy from Debian's packages, the load balancer in front of the gateways in
# infra/docker-compose.yml (config: infra/haproxy/haproxy.cfg, mounted at the path below, where
# the official haproxy images read it too, so HAPROXY_IMAGE=haproxy:2.6 runs the same file):
#
#   docker build -f infra/haproxy.Dockerfile -t turnstream-haproxy infra
#
# BASE_IMAGE: a Debian bookworm image whose apt reaches a mirror (make test-deploy builds it on
# its own debootstrap base, with the host's mirror).

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN set -eu; \
    apt-get update -q; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends haproxy; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /usr/local/etc/haproxy
EXPOSE 8000
USER haproxy
# -W: master-worker (a reload keeps serving); -db: stay in the foreground, log to stderr.
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
