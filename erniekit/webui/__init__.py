"""The gradio WebUI (`erniekit webui`)."""
