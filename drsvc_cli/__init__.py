"""The `drsvc` command line: an edge that speaks gRPC to a site's plugin socket."""
