"""Generic DRA kubelet-plugin machinery, with no GPU knowledge: what Go's ``k8s.io/dynamic-resource-allocation``
``kubeletplugin`` and ``resourceslice`` helpers do, entered through :mod:`driver.kubeletplugin.helper`.
Nothing here imports the GPU code or the simulation (a test walks every module's imports).
"""
