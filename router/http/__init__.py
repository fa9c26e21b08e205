"""The OpenAI-compatible HTTP API of the router (the second door beside gRPC)."""

from router.http.app import OpenAIDoor
from router.http.chat import ChatTemplate
from router.http.translate import Translator
from router.http.uvicorn_server import HttpServer

__all__ = ["ChatTemplate", "HttpServer", "OpenAIDoor", "Translator"]
