"""Job files of other trainers (ai-toolkit, kohya sd-scripts): recognising them (`detect`) and importing them as
difftune jobs (`python run.py --import-config`). Torch-free: a file is recognised before any library loads."""
