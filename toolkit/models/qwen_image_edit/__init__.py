"""Qwen-Image-Edit and Edit-Plus (2509, 2511): image editing on the Qwen-Image transformer (`arch: qwen_image_edit`)."""
