"""The package version, in a module of its own so that code inside the package can name it without importing the
package root (whose imports would then form a cycle)."""

__version__ = "0.1.0"
