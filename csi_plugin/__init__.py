"""gRPC edge of drsvc: CSI and CSI-Addons servicers over the drsvc core."""
