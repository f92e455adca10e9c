"""difftune's building blocks: config, models, data, training maths, networks, outputs."""
