"""AiVedio control plane: the domain core shared by every Lambda function and the local runtime."""
__version__ = "0.1.0"
