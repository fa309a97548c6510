#!/usr/bin/env bash
# Regenerate the protobuf/gRPC Python modules from kvstore.proto (run from anywhere).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
"$py" -m grpc_tools.protoc -I"$here" --python_out="$here" --pyi_out="$here" --grpc_python_out="$here" "$here/kvstore.proto"
# protoc emits "import kvstore_pb2"; make it a package-relative import.
sed -i 's/^import kvstore_pb2 as kvstore__pb2/from kvstore.proto import kvstore_pb2 as kvstore__pb2/' "$here/kvstore_pb2_grpc.py"
