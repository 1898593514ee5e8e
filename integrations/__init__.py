"""hybrid_dist.integrations: adapters to training frameworks that are optional extras.

Each submodule imports its framework only when one of its names is first used, so
``import hybrid_dist.integrations.<name>`` works without it; the core never imports this
package. ``torchtitan``: a model converter (``HybridLinearConverter``) for torchtitan's
config-tree converters (``pip install -e ".[torchtitan]"``).
"""
