"""Generic DRA kubelet-plugin machinery, with no GPU knowledge.

This subpackage plays the role of Go's ``k8s.io/dynamic-resource-allocation/kubeletplugin``
and ``resourceslice`` helpers: sockets and registration, the DRA gRPC services, fetching
claims, publishing ResourceSlices, liveness and telemetry. A driver only implements
:class:`driver.kubeletplugin.types.DRADriver` and calls :func:`driver.kubeletplugin.helper.start`.
Nothing here imports the GPU code or the simulation (a test walks every module's imports).
"""
