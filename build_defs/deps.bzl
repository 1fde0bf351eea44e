"""gpipe_dependencies(): every repository gpipe's BUILD files name, for gpipe's own
WORKSPACE and for a workspace that depends on gpipe (one list for both).

In the depending workspace:

    local_repository(name = "gpipe", path = "path/to/gpipe")   # or http_archive(...)
    load("@gpipe//build_defs:deps.bzl", "gpipe_dependencies")
    gpipe_dependencies()

Everything comes from the local machine (Debian's packages under /usr and the CUDA
toolkit when nvcc exists, with cuDNN's frontend headers where ./gpipe fetched them from
PyPI into a cache outside the tree); Bazel downloads nothing. Labels below are Label()s, so they
name gpipe's files from whichever workspace calls this. The repository names are fixed:
gpipe's BUILD files refer to them as @yaml_cpp, @doctest, ...; a name the workspace
declared already is left as it is.
"""

load("//build_defs:cuda_configure.bzl", "cuda_configure")
load("//build_defs:cudnn_frontend_configure.bzl", "cudnn_frontend_configure")

# Libraries from the machine's packages: repository name -> its BUILD file in third_party/.
_SYSTEM_LIBRARIES = [
    "yaml_cpp",
    "spdlog",
    "doctest",
    "openblas",
    "onednn",
    "libxsmm",
    "mpi",
    "nlohmann_json",
    "xxhash",
    "cli11",
]

# Offline stand-ins for rules that Bazel 4's WORKSPACE suffix would otherwise download
# (Debian's bazel-bootstrap embeds no copies): directories of third_party/.
_STAND_INS = ["rules_cc", "rules_java", "remote_coverage_tools"]

def _gpipe_directory_impl(ctx):
    # A directory of gpipe's tree, wherever gpipe lives (main workspace, local_repository
    # or an unpacked http_archive): found from a file in it, its entries linked here.
    src = ctx.path(ctx.attr.anchor).dirname.get_child(ctx.attr.directory)
    for entry in src.readdir():
        ctx.symlink(entry, entry.basename)

_gpipe_directory = repository_rule(
    implementation = _gpipe_directory_impl,
    local = True,
    attrs = {
        "anchor": attr.label(mandatory = True),  # a file next to `directory`
        "directory": attr.string(mandatory = True),
    },
)

def gpipe_dependencies():
    """Declares gpipe's third-party repositories (see the file's docstring)."""
    for name in _STAND_INS:
        if not native.existing_rule(name):
            _gpipe_directory(name = name, anchor = Label("//third_party:BUILD"), directory = name)

    # CUDA toolkit from $CUDA_PATH (default /usr/local/cuda); a stub repository with the
    # same target names when nvcc is absent, so everything loads everywhere.
    if not native.existing_rule("local_cuda"):
        cuda_configure(name = "local_cuda")

    # cuDNN's frontend headers, fetched by ./gpipe from PyPI; an empty stand-in where absent.
    if not native.existing_rule("cudnn_frontend"):
        cudnn_frontend_configure(name = "cudnn_frontend")

    for name in _SYSTEM_LIBRARIES:
        if not native.existing_rule(name):
            native.new_local_repository(
                name = name,
                build_file = str(Label("//third_party:%s.BUILD" % name)),
                path = "/usr",
            )
