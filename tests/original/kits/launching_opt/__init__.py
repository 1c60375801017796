__version__ = "1.4"
