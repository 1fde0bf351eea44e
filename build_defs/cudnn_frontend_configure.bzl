"""Repository rule: NVIDIA's cuDNN frontend headers (MIT), as @cudnn_frontend.

The headers are not in the tree: ./gpipe fetches them from PyPI (the wheel
nvidia-cudnn-frontend carries them in include/) into $GPIPE_CUDNN_FRONTEND, by default
${XDG_CACHE_HOME:-$HOME/.cache}/gpipe/cudnn_frontend, before it runs Bazel. Where they
are, :headers exposes them and defs.bzl says CUDNN_FRONTEND_AVAILABLE = True (the CUDA
backend then runs attention through cuDNN's fused SDPA); where not, :headers is empty and
the CUDA backend keeps its exact attention for every type.
"""

def _cudnn_frontend_configure_impl(ctx):
    root = ctx.os.environ.get("GPIPE_CUDNN_FRONTEND", "")
    if not root:
        cache = ctx.os.environ.get("XDG_CACHE_HOME", "") or (ctx.os.environ.get("HOME", "/nonexistent") + "/.cache")
        root = cache + "/gpipe/cudnn_frontend"
    include = ctx.path(root + "/include")
    have = include.get_child("cudnn_frontend.h").exists
    if have:
        ctx.symlink(include, "include")
        ctx.file("BUILD", """cc_library(
    name = "headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
""")
    else:
        ctx.file("BUILD", 'cc_library(name = "headers", visibility = ["//visibility:public"])\n')
    ctx.file("defs.bzl", "CUDNN_FRONTEND_AVAILABLE = %s\nCUDNN_FRONTEND_PATH = %r\n" % (have, root if have else ""))

cudnn_frontend_configure = repository_rule(
    implementation = _cudnn_frontend_configure_impl,
    environ = ["GPIPE_CUDNN_FRONTEND", "HOME", "XDG_CACHE_HOME"],
    local = True,
)
