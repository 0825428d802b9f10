"""Transitional re-export: the ResourceClaim model now lives in :mod:`driver.kubeletplugin.claimmodel`.

Only driver/kubeletplugin/types.py still imports it from here; delete this file once that import
names claimmodel (a one-line edit).
"""

from driver.kubeletplugin.claimmodel import ResourceClaim as ResourceClaim
