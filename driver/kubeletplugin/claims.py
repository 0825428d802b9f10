"""Transitional re-export: claim fetching now lives in :mod:`driver.kubeletplugin.claimfetch`.

Only driver/kubeletplugin/service.py still imports it from here; delete this file once that
import names claimfetch (a one-line edit).
"""

from driver.kubeletplugin.claimfetch import ClaimError as ClaimError
from driver.kubeletplugin.claimfetch import ClaimSource as ClaimSource
