"""The API's one error type: a refusal in OpenAI's shape, {"error": {"message", "type",
"code"}}, with its HTTP status."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind,
                                       "code": self.code}}, status_code=self.status)
