"""Small helpers for setting up ranks."""
import socket


def get_open_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the ranks' rendezvous; the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
