"""The Gradio front end: `build_demo(engines)` returns the app's Blocks (chat + engine panels);
`show_result(llm, output)` renders one result's panels in a notebook without a server."""

from ui.layout import build_demo
from ui.notebook import show_result

__all__ = ["build_demo", "show_result"]
