"""The server's errors, shaped as OpenAI's (`{"error": {"message", "type", "param", "code"}}`) or, on the routes of
Hugging Face text-embeddings-inference (TEI), as TEI's (`{"error", "error_type"}`)."""

# HTTP status -> OpenAI error type, TEI error_type
TYPES = {
    400: ("invalid_request_error", "Empty"),  # on TEI's routes a 400 is an empty input; the rest is 422
    401: ("authentication_error", "Unauthorized"),
    404: ("not_found_error", "Validation"),
    405: ("invalid_request_error", "Validation"),
    408: ("invalid_request_error", "Validation"),
    413: ("invalid_request_error", "Validation"),
    422: ("invalid_request_error", "Validation"),
    424: ("server_error", "Backend"),
    429: ("rate_limit_error", "Overloaded"),
    500: ("server_error", "Backend"),
    503: ("server_error", "Unhealthy"),
}


class ApiError(Exception):
    """An answer other than 200: its status, a message naming the field and what to do, the offending field
    (`param`) and a machine-readable `code`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai(self) -> dict:
        kind = TYPES.get(self.status, TYPES[500])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def tei(self) -> dict:
        return {"error": self.message, "error_type": TYPES.get(self.status, TYPES[500])[1]}
