"""asyncloco: asynchronous Local-SGD (Delayed Nesterov + Dynamic Local Updates) over hivemind."""

__version__ = "0.1.0"
