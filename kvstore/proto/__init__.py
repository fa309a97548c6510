"""Generated protobuf/gRPC code (see generate.sh). Do not edit the *_pb2*.py files by hand."""
