package flywheel;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.attribute.BasicFileAttributes;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;

/**
 * The catalog's keys of each item (streaming/history.py: write_item_keys, a JSON object item id -> its keys'
 * values in the spec's order, null for none), for events that do not carry a key in their context. The file is read again when it changes, looked at no
 * more than once every RECHECK_MS, so a catalog loaded while the job runs reaches live events within
 * seconds; a file that cannot be read keeps the keys last read (logged).
 */
final class ItemKeys {
    static final long RECHECK_MS = 2_000L;
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final org.slf4j.Logger LOG = org.slf4j.LoggerFactory.getLogger(ItemKeys.class);

    private final Path path;
    private static final String[] NONE = {};
    private Map<String, String[]> keys = Map.of();
    private List<Object> loaded;
    private long checkedAt;  // 0: the first get reads the file

    /** `path` empty: no catalog, no key for any item. */
    ItemKeys(String path) {
        this.path = path == null || path.isEmpty() ? null : Path.of(path);
    }

    /** The item's keys (an entry null, or the array shorter, where the catalog has none). */
    String[] get(String item) {
        long now = System.currentTimeMillis();
        if (path != null && now - checkedAt >= RECHECK_MS) {
            checkedAt = now;
            reload();
        }
        return keys.getOrDefault(item, NONE);
    }

    private void reload() {
        List<Object> version;  // the file's modification time, inode and size: a replace changes them
        try {
            BasicFileAttributes attributes = Files.readAttributes(path, BasicFileAttributes.class);
            version = Arrays.asList(attributes.lastModifiedTime(), attributes.fileKey(), attributes.size());
        } catch (NoSuchFileException e) {
            return;  // no item table yet: the events keep no key
        } catch (IOException e) {
            LOG.warn("item keys {}: {}", path, e.toString());
            return;
        }
        if (version.equals(loaded)) return;
        loaded = version;
        try {
            JsonNode node = JSON.readTree(path.toFile());
            Map<String, String[]> read = new HashMap<>(node.size() * 2);
            for (Map.Entry<String, JsonNode> entry : node.properties()) {
                JsonNode values = entry.getValue();
                String[] of = new String[values.size()];
                for (int i = 0; i < of.length; i++) {
                    of[i] = values.get(i).isNull() ? null : values.get(i).asText();
                }
                read.put(entry.getKey(), of);
            }
            keys = read;
            LOG.info("item keys {}: {} items", path, read.size());
        } catch (IOException | RuntimeException e) {
            LOG.warn("item keys {}: not read, the {} read before kept: {}", path, keys.size(), e.toString());
        }
    }
}
