# One image for inferlb's Python services (xds_server, ext_authz, ext_proc, epp, gpusim); docker-compose.yml picks the
# module to run. Envoy runs from the official Envoy image.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inferlb ./inferlb
COPY xds_server ./xds_server
COPY ext_proc ./ext_proc
COPY ext_authz ./ext_authz
COPY epp ./epp
COPY simulation ./simulation
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT ["python", "-m"]
