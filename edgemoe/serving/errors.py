"""The error every API answers a bad request with: a 400 (or `status`) naming the field.

Its own module because everything that reads a request raises it: the chat templates,
the conversation (chat), the fields (http), the grammars (constrain) and each API."""

from typing import Optional


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
