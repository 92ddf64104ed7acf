"""kronk_wsgi as a gRPC worker of the SGLang engine protocol, behind a gateway that tokenizes (``kronk-wsgi grpc``)."""
