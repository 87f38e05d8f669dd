"""The design space: typed directives, validity rules with reasons, capabilities, templates."""

from commweave.space.directives import (
    BACKENDS, COMPRESSION_ERROR, COMPRESSIONS, DIMENSIONS, GROUP_SIZES, ISSUERS, LANGUAGES, PLACEMENTS, SYNC_SCOPES,
    Capabilities, DirectiveSet, Space, filter_capable,
)
from commweave.space.template import DIRECTIVES_PREFIX, Template, directives_header, directives_of, program_body

__all__ = [
    "BACKENDS", "COMPRESSIONS", "COMPRESSION_ERROR", "DIMENSIONS", "DIRECTIVES_PREFIX", "GROUP_SIZES", "ISSUERS",
    "LANGUAGES", "PLACEMENTS", "SYNC_SCOPES", "Capabilities", "DirectiveSet", "Space", "Template",
    "directives_header", "directives_of", "filter_capable", "program_body",
]
