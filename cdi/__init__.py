"""CDI (Container Device Interface) spec files: models, the minimum-version rule and atomic writes.

Container runtimes (containerd, CRI-O, podman, Docker) inject devices into containers from CDI spec
files in ``/etc/cdi`` and ``/var/run/cdi``, loaded by the reference Go library. This package builds
and checks those files so that the runtimes accept them: :class:`Spec` and its parts reject what
the loader rejects, :func:`with_minimum_version` declares exactly the version the content needs,
and :func:`write_spec` replaces a file atomically so a runtime never reads half of one.

Modules: ``spec`` (the spec model), ``edits`` (its parts: container edits, devices), ``names``
(kind, device name and qualified ID rules), ``version`` (the minimum-version rule), ``store`` (spec
files on disk), ``atomicfile`` (the one atomic file write, also used by the driver's checkpoint),
``yamlload`` (the one strict YAML loader).

It has no GPU knowledge and can serve any CDI producer.
"""

from cdi.edits import (
    DEVICE_NODE_TYPES,
    HOOK_NAMES,
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    IntelRdt,
    LinuxNetDevice,
    Mount,
)
from cdi.names import check_device_name, parse_qualified_name, qualified_device_name, split_kind
from cdi.spec import (
    Spec,
    SpecError,
    minimum_version,
    minimum_version_reason,
    validation_problems,
    with_minimum_version,
)
from cdi.store import (
    SPEC_EXTENSIONS,
    list_specs,
    read_spec,
    remove_spec,
    spec_file_intact,
    transient_spec_name,
    write_spec,
    write_spec_text,
)
from cdi.version import (
    FLOOR_VERSION,
    LATEST_VERSION,
    VALID_VERSIONS,
    is_valid_version,
    normalize_version,
    version_at_least,
)

__all__ = [
    "DEVICE_NODE_TYPES",
    "FLOOR_VERSION",
    "HOOK_NAMES",
    "LATEST_VERSION",
    "SPEC_EXTENSIONS",
    "VALID_VERSIONS",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Hook",
    "IntelRdt",
    "LinuxNetDevice",
    "Mount",
    "Spec",
    "SpecError",
    "check_device_name",
    "is_valid_version",
    "list_specs",
    "minimum_version",
    "minimum_version_reason",
    "normalize_version",
    "parse_qualified_name",
    "qualified_device_name",
    "read_spec",
    "remove_spec",
    "spec_file_intact",
    "split_kind",
    "transient_spec_name",
    "validation_problems",
    "version_at_least",
    "with_minimum_version",
    "write_spec",
    "write_spec_text",
]
