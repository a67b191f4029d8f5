// FlinkSql: runs Flink SQL files in a local MiniCluster (batch mode) and prints the last
// statement's rows as CSV; no PyFlink, only Flink's jars (scripts/flink-jars fetches them).
//
//   java -cp "JARS_DIR/*" FlinkSql.java [name=value ...] FILE.sql [FILE.sql ...]
//
// Statements end with ';' at the end of a line; '--' comment lines are skipped. '${name}' in a
// file is replaced by the value given as name=value (say, the broker and the topic). The last
// statement's result is printed: a header line, then one line per row (Java's shortest exact
// decimal for doubles).
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;
import org.apache.flink.table.api.EnvironmentSettings;
import org.apache.flink.table.api.TableEnvironment;
import org.apache.flink.table.api.TableResult;
import org.apache.flink.types.Row;
import org.apache.flink.util.CloseableIterator;

public class FlinkSql {
    public static void main(String[] args) throws Exception {
        Map<String, String> vars = new HashMap<>();
        List<String> statements = new ArrayList<>();
        for (String arg : args) {
            int eq = arg.indexOf('=');
            if (eq > 0 && !arg.endsWith(".sql")) {
                vars.put(arg.substring(0, eq), arg.substring(eq + 1));
                continue;
            }
            String text = Files.readAllLines(Path.of(arg)).stream()
                    .filter(l -> !l.strip().startsWith("--"))
                    .collect(Collectors.joining("\n"));
            for (Map.Entry<String, String> v : vars.entrySet()) {
                text = text.replace("${" + v.getKey() + "}", v.getValue());
            }
            for (String st : text.split(";\\s*(\n|$)")) {
                if (!st.isBlank()) {
                    statements.add(st.strip());
                }
            }
        }
        if (statements.isEmpty()) {
            System.err.println("usage: FlinkSql [name=value ...] FILE.sql [FILE.sql ...]");
            System.exit(2);
        }
        TableEnvironment env = TableEnvironment.create(EnvironmentSettings.inBatchMode());
        env.getConfig().set("parallelism.default", "1");
        env.getConfig().set("table.local-time-zone", "UTC");
        TableResult last = null;
        for (String st : statements) {
            last = env.executeSql(st);
        }
        System.out.println(String.join(",", last.getResolvedSchema().getColumnNames()));
        try (CloseableIterator<Row> rows = last.collect()) {
            while (rows.hasNext()) {
                Row row = rows.next();
                List<String> cells = new ArrayList<>();
                for (int i = 0; i < row.getArity(); i++) {
                    Object cell = row.getField(i);
                    cells.add(cell == null ? "" : cell.toString());
                }
                System.out.println(String.join(",", cells));
            }
        }
        System.exit(0); // the MiniCluster's threads would keep the JVM alive
    }
}
