"""The format: what is on disk and how to open it.

    pack      the edgemoe pack (resident weights, one aligned record per expert, manifest)
    records   its records; resident: its safetensors files; config_match: its layout
              against config.json; writer: writing one (edgemoe.convert uses it)
    inplace   an mlx-lm quantized checkpoint read as it is, several reads per expert
    source    the one opener of both (`open_source`), the bundled model, a pack's assets
    families  what a family's config and names say: the refused families, routers, layer
              numbers, KV bytes (its experts are found by mlx-lm's model: handed in)

`edgemoe.convert` writes packs. Nothing here imports MLX.
"""
