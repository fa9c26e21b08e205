"""The OpenAI-compatible HTTP API of the router (the second door beside gRPC)."""

from router.http.app import OpenAIDoor
from router.http.chat import ChatTemplate
from router.http.server import HttpServer
from router.http.translate import Translator

__all__ = ["ChatTemplate", "HttpServer", "OpenAIDoor", "Translator"]
