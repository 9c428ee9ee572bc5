"""Request logging with secrets redacted (fields marked csi_secret, and maps named secrets)."""
from __future__ import annotations

import logging
import time

import grpc
from google.protobuf import message as pb_message
from google.protobuf.descriptor import FieldDescriptor

from .gen import csi_pb2

log = logging.getLogger("csi_plugin.rpc")
REDACTED = "***stripped***"


def _is_secret(field: FieldDescriptor) -> bool:
    opts = field.GetOptions()
    try:
        if opts.Extensions[csi_pb2.csi_secret]:
            return True
    except KeyError:
        pass
    return field.name == "secrets"


def redact(msg: pb_message.Message) -> pb_message.Message:
    """A copy of *msg* with every secret field replaced; the original is untouched."""
    out = type(msg)()
    out.CopyFrom(msg)
    _strip(out)
    return out


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 7 dropped FieldDescriptor.label; is_repeated is its replacement
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def _strip(msg: pb_message.Message) -> None:
    for field, value in msg.ListFields():
        if _is_secret(field):
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                container = getattr(msg, field.name)
                keys = list(container.keys())
                for k in keys:
                    container[k] = REDACTED
            elif field.type == FieldDescriptor.TYPE_STRING and not _repeated(field):
                setattr(msg, field.name, REDACTED)
            else:
                msg.ClearField(field.name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                    for v in getattr(msg, field.name).values():
                        _strip(v)
            elif _repeated(field):
                for v in value:
                    _strip(v)
            else:
                _strip(value)


def _short(msg) -> str:
    text = str(msg).replace("\n", " ").strip()
    return text if len(text) < 600 else text[:600] + "..."


class LoggingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method
        inner = handler.unary_unary

        def logged(request, context):
            start = time.monotonic()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s <- %s", method, _short(redact(request)))
            try:
                resp = inner(request, context)
            except BaseException:
                code = context.code() if hasattr(context, "code") else None
                log.info("%s -> %s (%.1f ms)", method, code, (time.monotonic() - start) * 1000)
                raise
            log.info("%s -> OK (%.1f ms)", method, (time.monotonic() - start) * 1000)
            return resp

        return grpc.unary_unary_rpc_method_handler(
            logged, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
