"""The Open Inference Protocol (KServe v2, Triton's): HTTP and gRPC, the generate and
repository extensions."""
