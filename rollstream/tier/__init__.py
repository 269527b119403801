"""A tier declared once and run by one runtime: what a tier is (``declaration``), what it builds
from (``context``), how it runs (``runtime``) and how long its shutdown may take (``shutdown_bound``)."""
