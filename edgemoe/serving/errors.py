"""The error every API answers a bad request with: a 400 (or `status`) naming the field.

Its own module because everything that reads a request raises it: the chat templates,
the conversation (chat), the fields (fields), the grammars (constrain) and each API."""

from typing import Optional

from starlette.responses import JSONResponse


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    """The shape of an error no API owns (a refused Host, an unknown route, a bug):
    OpenAI's, which most clients read (the other APIs bring their own)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status)
